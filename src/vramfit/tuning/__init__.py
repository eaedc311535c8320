"""How a step runs, chosen without changing its maths: the micro-batch verified on the card by a
probe step and cached (`probe`), the fastest fit measured on the run's own batches (`fit`), and a
micro-batch for each image size of a progressively resized run (`size_plans`).
"""

"""One run, read top to bottom in `run`: built into one typed `Run` (`build`), its epochs (`loop`),
one optimizer step (`step`: the step maths the planner traces too), one evaluation (`validation`).
Beside them: which epochs train what (`phases`), the optimizer and its LR schedule (`optim`), the
trainer's state a checkpoint records (`state`), the figures a finished run is compared by
(`summary`), what a person watching sees (`progress`), and the debug fault injections (`faults`).
"""

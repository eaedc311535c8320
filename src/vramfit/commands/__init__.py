"""The commands besides `train` and `plan`, one module each: eval, predict, export, compare, doctor,
scan-data, prepare, lr-find; and what they share: a finished run's model (`trained`), its model
card, plain-text tables.
"""

"""The process a run lives in: Accelerate, threads and logging (`launch`), the precision it runs in,
what processes say to each other (`collectives`), stop signals, the terminal's foreground,
OpenMP's wait, why there is no GPU (`gpucheck`), and storage faults told apart from the program's.
"""

"""What a run writes and reads back: every path of a run folder (`runfolder`), atomic checkpoints,
which checkpoint a run resumes from (`resume`), metrics.jsonl and the trackers (`tracking`), the
accuracy an evaluation counts, the figures, and the caches written outside the run folder.
"""

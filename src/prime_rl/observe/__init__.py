"""What users watch: readers of a run directory, never writers of what processes write
(``status``: the tmux status pane and headless summary; ``report``: the run's report)."""

"""Hardware model (issue 14): profiles, the scheduler that re-times a run's stage graph on
them, and `kvbench project` (kvbench.hwmodel.project). See profile.py for the profile
format, schedule.py for the timing model, this.py for `--hardware this`."""

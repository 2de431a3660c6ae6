"""Who runs when: the `Scheduler` (scheduler.py: admission, abort, finish, sit-out, capacity), the
step clock and step cost it paces admission by (pacing.py), sit-out (sit_out.py), the step costs
measured at startup (calibrate.py), and what it keeps per request (request.py)."""

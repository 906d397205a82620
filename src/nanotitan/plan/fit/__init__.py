"""The planner's fitting tools: what ties its model to measurements (the model itself is the package above).

    calibrate.py  score predictions against measured layouts (calibrate), fit a profile's constants (fit_profile)
    interval.py   prediction intervals from the calibration residuals of each term (docs/planner.md §7)
    machine.py    this machine kind's calibration: fitted once, cached per kind, scored on held-out layouts
    measure.py    `nanotitan plan --measure` (this machine's profile) and TensorBytesMeter
"""

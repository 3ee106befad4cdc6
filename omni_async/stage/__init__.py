"""The stage, split by concern: intake, emission, the stepper, and the control API."""

"""The pieces of one tune iteration that ``dpq/tune_loop.py`` drives: the split of a batch over
lanes, the gradient exchange and its sign format, the step, the watchdog, compile counts."""

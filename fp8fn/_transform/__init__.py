"""`fp8fn.transform` and what runs the user's module with it.

Code here forwards the model's own calls, so an error raised in it is the model's, not fp8fn's
(`fp8fn.init` blames the example inputs: `_core/error_origin.py`'s `raised_by_fp8fn`).
"""

FORWARDS_THE_MODEL = True  # read by `raised_by_fp8fn` for every module of this package

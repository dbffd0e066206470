"""EAGLE-3: a draft that reads the target's low, mid and high states and drafts a chain one
step at a time, trained with training-time test (model.py has the architecture)."""

from __future__ import annotations

NAME = "eagle3"
TITLE = "EAGLE-3"
SERVING_METHOD = "eagle3"

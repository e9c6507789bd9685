"""Experiments over placements: side-by-side comparisons, one-knob sweeps, and their reports."""

"""Test helpers shared by the project's tests (multi-rank launcher, numerical references)."""

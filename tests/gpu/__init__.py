"""Tests that need a CUDA GPU (marker: gpu)."""

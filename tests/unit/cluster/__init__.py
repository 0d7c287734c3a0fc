"""Tests of omlx.cluster."""

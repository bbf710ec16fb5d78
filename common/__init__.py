"""Helpers shared by every stage."""

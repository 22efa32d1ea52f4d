"""Helpers and independent references shared by the unit and end-to-end tests."""

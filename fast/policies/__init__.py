"""Policies built on the meter: gates (repair what the certificate flags), evictors, PAGE."""

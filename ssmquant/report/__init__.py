"""Reporting: tables, JSON and plots made from traces and format footprints."""

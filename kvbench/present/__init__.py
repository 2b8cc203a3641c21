"""Presentation: records turned into tables for people (markdown), from declarations."""

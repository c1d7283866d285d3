"""modalmesh: the shared runtime every modalmesh service embeds."""

__version__ = "0.1.0"

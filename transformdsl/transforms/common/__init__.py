"""Building blocks several transform families share."""

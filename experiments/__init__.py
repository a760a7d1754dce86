"""Dated studies of flowrl (not the front door): their scripts, results and records; LOG.md says what each found."""

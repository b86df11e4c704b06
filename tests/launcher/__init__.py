"""poprun itself: its command line, plan, launch, supervision, output and failures."""

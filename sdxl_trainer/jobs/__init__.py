"""The two jobs as their scripts start them, each read as configuration -> build -> run."""

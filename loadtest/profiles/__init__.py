"""Named engine step-time profiles (YAML, read by `loadtest.engine.profile.load_profile`)."""

"""`reinforge ui`: a local web page to browse a run's rollouts (see `app.py`)."""

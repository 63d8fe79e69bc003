"""The OpenAI-compatible HTTP front end over the router (``pdlab serve``)."""

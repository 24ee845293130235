"""The router's OpenAI-compatible HTTP front: app.py serves it; models.py,
completions.py, responses.py, tokenize.py and ops.py are its surfaces' routes;
front.py their shared logic; protocol.py (and responses_request.py) the request
bodies, bodies.py and responses_stream.py the answers, tools.py the tool-call
parsers, errors.py and sse.py the error and event shapes."""

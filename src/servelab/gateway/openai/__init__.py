"""OpenAI request fields: the pydantic protocol, structured-output and tool fields, and their checks."""

"""The HTTP server program (`actorserve serve`): aiohttp routes for the OpenAI-compatible and
SGLang-native APIs, their schemas, chat templates with tools and reasoning, metrics and the
command line. It runs in the frontend process and drives an `api.frontend.Engine`."""

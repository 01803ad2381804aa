"""A serving process (`trserve serve`, `trserve worker`): a worker (services/worker) and, with
--http-port, the OpenAI-compatible API over its front door (services/openai). The only place the two
meet: the worker takes the API as a `FrontEnd` it never imports; the API imports the worker."""

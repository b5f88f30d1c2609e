"""OpenAI protocol edge: request/response models (`protocol`, `responses`), the `nemotron_3` reasoning
parser (`reasoning`), the `qwen3_coder` tool-call parser (`tool_calls`) and both chained per chat choice
(`chat_output`). Pydantic lives here and in `service.deployments`, never in `service.engine`."""

# One image for the API and the worker agents: Node.js for the TypeScript processes,
# Python with torch + transformers + PEFT for the engine. The default torch wheel from
# PyPI is the CUDA build; pass --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# style mirrors for a CPU-only image.
FROM node:20-bookworm-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl tini \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --no-audit --no-fund

COPY workers/python/requirements.txt workers/python/requirements.txt
RUN python3 -m venv /app/.venv \
 && /app/.venv/bin/pip install --no-cache-dir -r workers/python/requirements.txt

COPY . .

ENV NODE_ENV=production TB_LOG_FORMAT=json TB_PYTHON=/app/.venv/bin/python TB_HOST=0.0.0.0
ENTRYPOINT ["/usr/bin/tini", "--"]
# docker-compose.yml gives each service its own `start --preset … --api-only | --agent ID` command.
CMD ["node", "--import", "tsx", "scripts/tinker-broker.ts", "start"]

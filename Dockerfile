# One image for the API, the workers and the scheduler.
# GPU hosts: build with the CUDA torch that matches the driver, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# The API process never imports torch; workers do.
FROM python:3.11-slim
ARG TORCH_SPEC="torch>=2.4"
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY replay_audit ./replay_audit
COPY migrations ./migrations
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --no-cache-dir "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else pip install --no-cache-dir "$TORCH_SPEC"; fi \
 && pip install --no-cache-dir -e '.[engine,tp]'
EXPOSE 8000
CMD ["replay-audit", "serve", "--host", "0.0.0.0", "--port", "8000"]

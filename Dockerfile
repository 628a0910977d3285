# syntax=docker/dockerfile:1
# The dockerfile:1 frontend gives BuildKit cache mounts (RUN --mount=type=cache).
#
# tollgate's container image: a release build in a full Rust image, then only the binary and a
# default config on a distroless base (no shell, no package manager, non-root).
#
#   docker build -t tollgate .
#   docker run --rm -p 8000:8000 tollgate                 # config/container.yaml: to app:8080
#   docker run --rm tollgate check                        # validate the baked-in config
#
# docs/operations.md ("Running as a container") explains the choices below.

# The toolchain must be at least Cargo.toml's rust-version (1.91, which the locked crates need
# too). 1.95 is the toolchain CI builds and tests with today, so the image holds what CI tested. Override with --build-arg RUST_VERSION=...
ARG RUST_VERSION=1.95
# Must be a Debian 12 (bookworm) image like the builder below: the binary links the builder's
# glibc dynamically. The debug-nonroot tag adds a busybox shell for troubleshooting.
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

# ---- build ----------------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# Only what the release build reads. benches/ is needed because Cargo.toml declares a bench
# target, and cargo refuses a manifest whose target file is missing. crates/ holds the allocator
# crate, a path dependency. tests/ is not needed. scripts/test.sh checks that cargo can load the
# manifest from exactly these files.
COPY Cargo.toml Cargo.lock build.rs ./
COPY benches ./benches
COPY crates ./crates
COPY src ./src
# The same command scripts/test.sh runs in CI, where no Docker engine exists, so CI proves that
# this step compiles. --locked: exactly the versions in Cargo.lock. The cache mounts keep
# downloaded crates and compiled dependencies between builds. target/ is a cache mount, so the
# binary is copied out of it into the layer.
# The commit `tollgate --version` names: the context has no .git (`--build-arg
# TOLLGATE_COMMIT=$(git rev-parse --short=12 HEAD)`).
ARG TOLLGATE_COMMIT=unknown
ENV TOLLGATE_COMMIT=${TOLLGATE_COMMIT}
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked \
 && install -D -m 0755 target/release/tollgate /out/tollgate

# ---- runtime --------------------------------------------------------------------------------
# distroless/cc: glibc, libgcc_s, CA certificates (https upstreams without `tls.ca` use the
# system roots) and a passwd file with `nonroot` (uid 65532). There is no shell, so everything
# below uses the exec (JSON) form.
FROM ${RUNTIME_IMAGE}
COPY --from=build /out/tollgate /usr/local/bin/tollgate
# Owned by root and read-only to the process: tollgate never writes its config. Mount a
# directory over /etc/tollgate to replace it; a reload follows changes in that directory.
COPY config/container.yaml /etc/tollgate/tollgate.yaml
# `run`, `check` and `health` all read this unless given --config.
ENV TOLLGATE_CONFIG=/etc/tollgate/tollgate.yaml
# 8000: the proxy listener. 9901: the admin listener (/healthz, /readyz, /metrics, /config).
# Uncomment 8443 with the TLS listener example in config/container.yaml.
EXPOSE 8000 9901
# EXPOSE 8443
# The uid as a number, not `nonroot`: Kubernetes' runAsNonRoot can only check a numeric user.
# Both ports are above 1024, so no capability is needed to bind them.
USER 65532:65532
# SIGTERM stops accepting connections and drains in-flight requests for `shutdown_timeout`
# (30s by default), then exits 0. `docker stop` waits only 10s by default: use -t 40.
STOPSIGNAL SIGTERM
# `tollgate health` sends GET /healthz to the admin address of $TOLLGATE_CONFIG (a wildcard
# address is reached on loopback). It exits 0 on a 200 and needs no shell or curl. It reads
# only `admin.address` from the file, without validating the rest: an invalid edit of the
# mounted file (which the running proxy refuses, serving its last good config) still checks
# healthy; a file that is not YAML, or has no `admin.address`, fails the check.
# `health --url http://127.0.0.1:9901/healthz` avoids reading the config.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/tollgate", "health"]
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["run"]

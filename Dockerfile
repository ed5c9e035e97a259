# syntax=docker/dockerfile:1
# outboxd container image: the Rust binary (linked against glibc) on distroless/cc (glibc,
# libgcc, CA certificates, no shell), running as the non-root user 65532.
#
#   docker build -t outboxd:dev .        (or: podman build -t outboxd:dev .)
#
# No protoc is needed: build.rs compiles the protos with protox. The image has no
# PostgreSQL: set OUTBOX_DATABASE__URL (the Helm chart always does); without it outboxd
# tries to start an embedded cluster and exits saying it found no PostgreSQL binaries.

FROM docker.io/library/rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# The commit that outbox_build_info reports: .git is not in the context, so pass it,
# `--build-arg OUTBOXD_BUILD_COMMIT=$(git rev-parse --short=12 HEAD)` (else "unknown").
ARG OUTBOXD_BUILD_COMMIT=""
# The caches keep the registry and target directory between builds (BuildKit, podman);
# the binary is copied out because a cache mount is not part of the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin outboxd \
    && install -D -m 0755 target/release/outboxd /out/outboxd

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=builder /out/outboxd /usr/local/bin/outboxd
# Inside a container the loopback default is unreachable (the chart sets this too). Off
# loopback outboxd also wants TLS (OUTBOX_TLS__*) or OUTBOX_ALLOW_PLAINTEXT=true, and says
# so at start: the image makes no security choice for you.
ENV OUTBOX_LISTEN_ADDR=0.0.0.0:50051
USER 65532:65532
EXPOSE 50051
ENTRYPOINT ["/usr/local/bin/outboxd"]
CMD ["serve"]

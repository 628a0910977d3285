#!/usr/bin/env bash
# Regenerate proto/gen/*.rs (committed) from proto/*.proto: needs protoc (apt-get install
# protobuf-compiler) and builds a throwaway generator on tonic-prost-build in a temp dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
cat > "$work/Cargo.toml" <<'TOML'
[package]
name = "tollgate-proto-gen"
version = "0.1.0"
edition = "2021"
[dependencies]
tonic-prost-build = "0.14"
TOML
cat > "$work/src/main.rs" <<'RS'
fn main() {
    let mut args = std::env::args().skip(1);
    let (out, proto) = (args.next().expect("out dir"), args.next().expect("proto dir"));
    tonic_prost_build::configure()
        .build_transport(false)
        .out_dir(out)
        .compile_protos(&[format!("{proto}/envoy/service/ratelimit/v3/rls.proto")], &[proto])
        .expect("the protos compile");
}
RS
cargo run -q --manifest-path "$work/Cargo.toml" -- "$root/proto/gen" "$root/proto"
mv "$root/proto/gen/envoy.r#type.v3.rs" "$root/proto/gen/envoy.type.v3.rs"

//! Generates the outboxd client from the repository's `proto/` with the pure-Rust `protox`,
//! so building needs no `protoc`. Client only, with tonic's default prost codec.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let descriptors = protox::compile(["outbox/v1/outbox.proto"], [&proto])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}

//! Generates the outboxd client from the repository's `proto/` with the pure-Rust `protox`,
//! so building needs no `protoc`. Client only, with tonic's default prost codec.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not baked in when it is compiled: a target directory
    // copied from another checkout reuses this script's binary (same fingerprint).
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR unset")?;
    let proto = std::path::Path::new(&manifest_dir).join("../../proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let descriptors = protox::compile(["outbox/v1/outbox.proto"], [&proto])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}

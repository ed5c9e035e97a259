//! Compiles `proto/` with the pure-Rust `protox` (no system `protoc`) and generates the
//! tonic server and client, both using `crate::codec::OutboxCodec` (undecodable requests
//! answer INVALID_ARGUMENT, not INTERNAL); recompiles the crate when migrations change
//! (`sqlx::migrate!`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=migrations");

    let descriptors = protox::compile(["outbox/v1/outbox.proto"], ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("outbox_descriptor.bin");
    std::fs::write(
        &descriptor_path,
        prost::Message::encode_to_vec(&descriptors),
    )?;

    tonic_prost_build::configure()
        .codec_path("crate::codec::OutboxCodec")
        .compile_fds(descriptors)?;
    Ok(())
}

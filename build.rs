//! Compiles `proto/` with the pure-Rust `protox` (no system `protoc`) and generates the
//! tonic server and client, both using `crate::codec::OutboxCodec` (undecodable requests
//! answer INVALID_ARGUMENT, not INTERNAL); recompiles the crate when migrations change
//! (`sqlx::migrate!`); records the commit built (`OUTBOXD_BUILD_COMMIT`, for the
//! `outbox_build_info` metric): that variable when set (an image built without `.git`),
//! else `git rev-parse`, else `unknown`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-env-changed=OUTBOXD_BUILD_COMMIT");
    let commit = std::env::var("OUTBOXD_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=OUTBOXD_BUILD_COMMIT={commit}");

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

/// `git rev-parse` of this checkout: the commit, after asking cargo to run this again when
/// HEAD or the branch it names moves.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = std::process::Command::new("git").args(args).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
    }
    // Only files that exist: cargo runs a build script whose watched file is missing
    // every time.
    for path in watched.into_iter().flatten() {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    Some(commit)
}

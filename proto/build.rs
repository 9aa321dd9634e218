//! Compiles `csi.proto`, `pluginregistration.proto` and `keys.proto` with protox (a pure-Rust protobuf
//! compiler), so building moor never needs a system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let files = ["csi.proto", "pluginregistration.proto", "keys.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    let descriptors = protox::compile(files, [&dir])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}

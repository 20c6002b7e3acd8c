//! Generates the gRPC code for `proto/retryd/v1` with a pure-Rust protobuf
//! compiler (protox), so a fresh machine needs no `protoc` binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The contract stays at the repository's root, beside the clients of
    // every language that read it; `proto` here is a link to it, so that
    // the published crate carries the file (cargo package follows it).
    let protos = ["proto/retryd/v1/retryd.proto"];
    let file_descriptors = protox::compile(protos, ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // The descriptor set also feeds server reflection.
    std::fs::write(
        out_dir.join("retryd_descriptor.bin"),
        prost::Message::encode_to_vec(&file_descriptors),
    )?;
    tonic_prost_build::configure()
        .skip_protoc_run()
        .compile_fds(file_descriptors)?;
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}

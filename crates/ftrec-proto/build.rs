// Generates the gRPC code from proto/ftrec.proto with a vendored protoc, so building needs
// no system protobuf compiler.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: set_var is unsound only when another thread reads the environment at the
    // same time; a build script's main runs on its only thread and has spawned none yet.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure()
        .bytes(".")
        .compile_protos(&["proto/ftrec.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/ftrec.proto");
    Ok(())
}

//! The `oci` command line.
fn main() {
    eprintln!("oci: no commands yet");
    std::process::exit(2);
}

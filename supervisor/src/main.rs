//! The `fleet-run-supervisor` command line.
fn main() {
    eprintln!("fleet-run-supervisor: no commands yet");
    std::process::exit(2);
}

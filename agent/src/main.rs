//! The `fleet-agent` command line.
fn main() {
    eprintln!("fleet-agent: no commands yet");
    std::process::exit(2);
}

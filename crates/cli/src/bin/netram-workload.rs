//! The bundled workload program (`touch`, `random`, `qsort`; see `netram_bench::workload`): an
//! ordinary process that knows nothing of netram, run by the tests, the benchmarks and the
//! demo under memory limits. Exit status 0 only if its data verified; 2 on a usage error.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match netram_bench::workload::run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(usage) if usage.starts_with("usage") => {
            eprintln!("{usage}");
            ExitCode::from(2)
        }
        Err(why) => {
            eprintln!("{why}");
            ExitCode::from(1)
        }
    }
}

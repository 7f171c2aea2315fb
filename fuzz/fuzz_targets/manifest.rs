#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ftrec_fuzz_targets::manifest(data));

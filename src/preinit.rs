//! The one check that must run before libtorch is loaded: a working directory that still
//! exists. Started from a deleted one, the process died inside libtorch's own start-up,
//! with oneMKL's "FATAL ERROR: Cannot load …/libtorch_cpu.so", which sends users to
//! reinstall libtorch. `main` is too late (libtorch is a load-time dependency and its
//! initialisers have run by then); the executable's `.preinit_array` runs before any
//! shared library is initialised.

/// Called by the dynamic loader before every shared library's initialisers. No Rust
/// runtime exists yet: only libc calls.
extern "C" fn check_working_directory() {
    let mut buf = [0u8; 4096];
    // SAFETY: getcwd writes at most `buf.len()` bytes into a buffer we own; errno is read
    // through libc's own accessor.
    let errno = unsafe {
        if !libc::getcwd(buf.as_mut_ptr().cast(), buf.len()).is_null() {
            return;
        }
        *libc::__errno_location()
    };
    let msg: &[u8] = match errno {
        // A path longer than the buffer is not a problem of the directory.
        libc::ERANGE => return,
        libc::ENOENT => {
            b"headroom: error: the current directory was deleted (or moved away) under this \
              shell; cd to an existing directory (cd \"$PWD\" if it was recreated) and run \
              again\n"
        }
        _ => {
            b"headroom: error: the current directory cannot be read (getcwd failed: check \
              the permissions of its parents); cd to a directory you can read and run again\n"
        }
    };
    // SAFETY: writing a static buffer to stderr, then ending the process.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::_exit(2);
    }
}

#[used]
#[link_section = ".preinit_array"]
static PREINIT: extern "C" fn() = check_working_directory;

//! Which device the run trains on, and what to call it on screen.
use std::fmt;

use headroom_core::{Bus, DeviceChoice, Level, Notice, Telemetry};
use tch::{Cuda, Device};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError(pub String);

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceError {}

/// The device for `choice`. `Auto` falls back to the CPU with a notice on `bus`; an
/// explicit CUDA device that is not there is an error.
pub fn resolve(choice: DeviceChoice, bus: &Bus) -> Result<Device, DeviceError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            if Cuda::is_available() {
                Ok(Device::Cuda(0))
            } else {
                bus.send(Telemetry::Notice(Notice::new(
                    Level::Info,
                    "device",
                    "no CUDA device found; training on CPU",
                )));
                Ok(Device::Cpu)
            }
        }
        DeviceChoice::Cuda(n) => {
            if !Cuda::is_available() {
                return Err(DeviceError(format!(
                    "device cuda:{n} was asked for, but libtorch sees no CUDA device; use \
                     --device cpu (or auto)"
                )));
            }
            let count = Cuda::device_count().max(0) as usize;
            if n >= count {
                return Err(DeviceError(format!(
                    "device cuda:{n} does not exist: this machine has {count} CUDA device(s) \
                     (cuda:0..cuda:{}); pick one of those or use --device cpu",
                    count.saturating_sub(1)
                )));
            }
            Ok(Device::Cuda(n))
        }
    }
}

/// `cpu` or `cuda:N`, as telemetry names devices.
pub fn label(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        Device::Cpu => "cpu".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// A human name: the CPU's model from /proc/cpuinfo; for CUDA only the index (the
/// sampler adds NVML's product name).
pub fn human_name(device: Device) -> String {
    match device {
        Device::Cpu => cpu_model().unwrap_or_else(|| "CPU".into()),
        other => label(other),
    }
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_falls_back_to_cpu_with_a_notice() {
        let (bus, rx) = Bus::new(false);
        let dev = resolve(DeviceChoice::Auto, &bus).unwrap();
        if Cuda::is_available() {
            assert_eq!(dev, Device::Cuda(0));
        } else {
            assert_eq!(dev, Device::Cpu);
            let Ok(Telemetry::Notice(n)) = rx.events.try_recv().map(|r| r.msg) else {
                panic!("expected a notice")
            };
            assert!(n.text.contains("training on CPU"));
        }
    }

    #[test]
    fn missing_cuda_device_says_use_cpu() {
        let (bus, _rx) = Bus::new(false);
        let err = resolve(DeviceChoice::Cuda(99), &bus)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--device cpu"), "{err}");
        assert_eq!(label(Device::Cpu), "cpu");
        assert!(!human_name(Device::Cpu).is_empty());
    }
}

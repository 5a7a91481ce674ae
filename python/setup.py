"""The wheel holds the built extension (_C) and the C++ library it links (found beside it
through $ORIGIN), so it is a platform wheel. torch is not declared: it is Debian's python3-torch,
seen from a venv made with --system-site-packages."""

from setuptools import find_packages, setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(
    packages=find_packages(include=["hyper_parallel", "hyper_parallel.*"]),
    package_data={"hyper_parallel": ["_C*.so", "libhyper_parallel.so*"]},
    distclass=BinaryDistribution,
    zip_safe=False,
)

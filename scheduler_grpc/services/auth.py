"""AuthService: sessions for people, API keys for services."""

from __future__ import annotations

from typing import Any

import grpc
from scheduler_client.v1 import auth_pb2, auth_pb2_grpc

from scheduler_grpc.application import Api
from scheduler_grpc.auth import Unauthenticated, current_principal
from scheduler_grpc.services import convert

Context = grpc.aio.ServicerContext[Any, Any]


class AuthService(auth_pb2_grpc.AuthServiceServicer):
    """Login/Logout/WhoAmI and API key management (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._auth = api.auth
        self._metrics = api.metrics

    async def Login(self, request: auth_pb2.LoginRequest, context: Context) -> auth_pb2.LoginResponse:
        try:
            session = await self._auth.login(request.username, request.password, context.peer())
        except Unauthenticated:
            self._metrics.login_failed()
            raise
        return auth_pb2.LoginResponse(
            token=session.token,
            expire_time=convert.timestamp(session.expire_time),
            role=convert.role_to_proto(session.role),
        )

    async def Logout(self, request: auth_pb2.LogoutRequest, context: Context) -> auth_pb2.LogoutResponse:
        await self._auth.logout(current_principal())
        return auth_pb2.LogoutResponse()

    async def WhoAmI(self, request: auth_pb2.WhoAmIRequest, context: Context) -> auth_pb2.WhoAmIResponse:
        principal = current_principal()
        return auth_pb2.WhoAmIResponse(principal=principal.name, role=convert.role_to_proto(principal.role))

    async def CreateApiKey(
        self, request: auth_pb2.CreateApiKeyRequest, context: Context
    ) -> auth_pb2.CreateApiKeyResponse:
        role = convert.role_from_proto(request.role)
        expires = None
        if request.HasField("expire_time"):
            expires = convert.from_timestamp(request.expire_time, "expire_time")
        created = await self._auth.create_api_key(current_principal(), request.display_name, role, expires)
        return auth_pb2.CreateApiKeyResponse(api_key=convert.api_key_to_proto(created.record), secret=created.secret)

    async def ListApiKeys(self, request: auth_pb2.ListApiKeysRequest, context: Context) -> auth_pb2.ListApiKeysResponse:
        page = await self._auth.list_api_keys(request.page_size, request.page_token)
        return auth_pb2.ListApiKeysResponse(
            api_keys=[convert.api_key_to_proto(record) for record in page.keys], next_page_token=page.next_page_token
        )

    async def RevokeApiKey(
        self, request: auth_pb2.RevokeApiKeyRequest, context: Context
    ) -> auth_pb2.RevokeApiKeyResponse:
        record = await self._auth.revoke_api_key(convert.resource_id(request.id))
        return auth_pb2.RevokeApiKeyResponse(api_key=convert.api_key_to_proto(record))
